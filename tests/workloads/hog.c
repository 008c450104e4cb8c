/* A container's job for tests/integration/test_podman_engine.py, built static (the container's
 * rootfs is this one file): grows by 1 MiB every 20 ms to TARGET MiB, each MiB filled with a
 * pattern of its own, counts to COUNT (a line "count N" per step, the log opened and closed
 * each time), then checks every MiB and writes "done COUNT ok" or "done COUNT corrupt".
 *   hog LOG TARGET_MIB COUNT */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MIB (1024L * 1024L)

static void say(const char *path, const char *line, long n) {
    FILE *log = fopen(path, "a");
    if (log == NULL)
        exit(3);
    fprintf(log, "%s %ld\n", line, n);
    fclose(log);
}

static unsigned long pattern(long block, long word) {
    return (unsigned long)block * 2654435761UL + (unsigned long)word * 40503UL + 1;
}

int main(int argc, char **argv) {
    if (argc != 4)
        return 2;
    const char *path = argv[1];
    long target = atol(argv[2]), count = atol(argv[3]);
    unsigned long **blocks = calloc((size_t)target, sizeof *blocks);
    long grown = 0;
    struct timespec step = {0, 20 * 1000 * 1000};
    if (blocks == NULL)
        return 3;
    for (long n = 1; n <= count; n++) {
        if (grown < target) {
            unsigned long *block = malloc(MIB);
            if (block == NULL)
                return 3;
            for (long w = 0; w < MIB / (long)sizeof *block; w++)
                block[w] = pattern(grown, w);
            blocks[grown++] = block;
        }
        say(path, "count", n);
        nanosleep(&step, NULL);
    }
    for (long b = 0; b < grown; b++)
        for (long w = 0; w < MIB / (long)sizeof **blocks; w++)
            if (blocks[b][w] != pattern(b, w)) {
                say(path, "done corrupt at block", b);
                return 1;
            }
    FILE *log = fopen(path, "a");
    if (log == NULL)
        return 3;
    fprintf(log, "done %ld ok\n", count);
    fclose(log);
    return 0;
}
