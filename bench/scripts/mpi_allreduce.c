/* MPI_Allreduce timed like nccl-tests' all_reduce_perf, the anchor for examples/allreduce.
 *
 *   mpirun -np 4 mpi_allreduce MINBYTES MAXBYTES FACTOR ITERS WARMUP
 *
 * f32 sum, in place. Per size: warm-up calls, a barrier, ITERS calls back to back; the time of
 * one call is the slowest rank's average. Rank 0 prints one line per size:
 *   bytes count time_us algbw_GBps busbw_GBps wrong
 * where busbw = algbw * 2(n-1)/n and wrong counts elements that differ from the exact sum
 * (checked once per size, after the timed calls, on freshly filled data).
 *
 *   mpi_allreduce memcpy BYTES
 *
 * (no mpirun) prints this machine's single-thread memcpy bandwidth in GB/s over BYTES-byte
 * buffers, best of 20 copies. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int memcpy_bw(long bytes) {
    char *a = malloc((size_t)bytes), *b = malloc((size_t)bytes);
    if (!a || !b || bytes <= 0) return 2;
    memset(a, 1, (size_t)bytes);
    memset(b, 2, (size_t)bytes);
    double best = 1e30;
    for (int i = 0; i < 20; i++) {
        double t0 = now();
        memcpy(i % 2 ? a : b, i % 2 ? b : a, (size_t)bytes);
        double t = now() - t0;
        if (t < best) best = t;
    }
    printf("%.3f\n", bytes / best / 1e9);
    free(a);
    free(b);
    return 0;
}

static float input(int rank, long i) { return (float)((i * 7 + rank * 13) % 17) - 8.0f; }

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "memcpy") == 0) return memcpy_bw(atol(argv[2]));
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc != 6) {
        if (rank == 0)
            fprintf(stderr, "usage: %s MINBYTES MAXBYTES FACTOR ITERS WARMUP\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    long min = atol(argv[1]), max = atol(argv[2]), factor = atol(argv[3]);
    int iters = atoi(argv[4]), warmup = atoi(argv[5]);
    if (min < 4 || max < min || factor < 2 || iters < 1 || warmup < 0) {
        if (rank == 0) fprintf(stderr, "bad arguments\n");
        MPI_Finalize();
        return 2;
    }
    float *buf = malloc((size_t)max);
    if (!buf) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    long total_wrong = 0;
    for (long bytes = min; bytes <= max; bytes *= factor) {
        long count = bytes / 4;
        for (long i = 0; i < count; i++) buf[i] = input(rank, i);
        for (int w = 0; w < warmup; w++)
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int it = 0; it < iters; it++)
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double mine = (MPI_Wtime() - t0) / iters, slowest = 0;
        MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        /* Check one call on fresh data. */
        for (long i = 0; i < count; i++) buf[i] = input(rank, i);
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        long wrong = 0, wrong_all = 0;
        for (long i = 0; i < count; i++) {
            float want = 0;
            for (int r = 0; r < world; r++) want += input(r, i);
            wrong += buf[i] != want;
        }
        MPI_Reduce(&wrong, &wrong_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        total_wrong += wrong_all;
        if (rank == 0) {
            double algbw = (double)(count * 4) / slowest / 1e9;
            printf("%ld %ld %.2f %.4f %.4f %ld\n", count * 4, count, slowest * 1e6, algbw,
                   algbw * 2.0 * (world - 1) / world, wrong_all);
            fflush(stdout);
        }
    }
    free(buf);
    MPI_Finalize();
    return rank == 0 && total_wrong != 0 ? 1 : 0;
}
