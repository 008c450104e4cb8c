"""oomguard: checkpoint the top memory consumer with CRIU instead of letting the OOM killer run."""

__version__ = "0.1.0"
