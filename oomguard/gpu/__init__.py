"""GPU building blocks: the NVML sensor (`nvml`), the cuda-checkpoint actuator (`cudackpt`) and the
host-RAM budget of a GPU checkpoint (`budget`). Nothing here needs a GPU to import."""
