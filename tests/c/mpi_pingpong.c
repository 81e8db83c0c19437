/*
 * An MPI program for Open MPI over UCX on vrdma (tests/tests/ucx_mpi.rs):
 * every rank plays ping-pong with its partner on the other tenant's device
 * (rank r with r + size/2), checking every byte of every message, at sizes
 * that take UCX's eager and rendezvous protocols; then all ranks run
 * MPI_Allreduce (sum and max) and check the results.
 *
 * Prints "rank R of N partner P OK" and exits 0, or names the first wrong
 * byte or result and aborts the job.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROUNDS 20
#define REDUCE_LEN 4096
#define REDUCE_ROUNDS 10

static const int sizes[] = {8, 4096, 65536, 1 << 20};

/* The byte `i` of a message `rank` sends in `round`. */
static uint8_t pattern(size_t i, int rank, int round)
{
    return (uint8_t)(i * 7 + (size_t)rank * 31 + (size_t)round);
}

static void fill(uint8_t *buf, size_t len, int rank, int round)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = pattern(i, rank, round);
}

static void check(const uint8_t *buf, size_t len, int from, int round, int me)
{
    for (size_t i = 0; i < len; i++) {
        if (buf[i] != pattern(i, from, round)) {
            fprintf(stderr,
                    "rank %d: message of %zu bytes from rank %d, round %d: byte %zu is %u, not %u\n",
                    me, len, from, round, i, buf[i], pattern(i, from, round));
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
}

int main(int argc, char **argv)
{
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size % 2 != 0) {
        fprintf(stderr, "an even number of ranks, please (%d)\n", size);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int partner = (rank + size / 2) % size;
    int first = rank < partner;
    size_t max = (size_t)sizes[sizeof(sizes) / sizeof(sizes[0]) - 1];
    uint8_t *out = malloc(max), *in = malloc(max);
    if (out == NULL || in == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t len = (size_t)sizes[s];
        for (int round = 0; round < ROUNDS; round++) {
            fill(out, len, rank, round);
            memset(in, 0, len);
            if (first) {
                MPI_Send(out, (int)len, MPI_BYTE, partner, round, MPI_COMM_WORLD);
                MPI_Recv(in, (int)len, MPI_BYTE, partner, round, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(in, (int)len, MPI_BYTE, partner, round, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
                MPI_Send(out, (int)len, MPI_BYTE, partner, round, MPI_COMM_WORLD);
            }
            check(in, len, partner, round, rank);
        }
    }

    /* Sum of (r + 1) * (i + round) over the ranks r, and their maximum. */
    long *mine = malloc(REDUCE_LEN * sizeof(long));
    long *sum = malloc(REDUCE_LEN * sizeof(long));
    long *top = malloc(REDUCE_LEN * sizeof(long));
    if (mine == NULL || sum == NULL || top == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    long ranks_sum = (long)size * (size + 1) / 2;
    for (int round = 0; round < REDUCE_ROUNDS; round++) {
        for (long i = 0; i < REDUCE_LEN; i++)
            mine[i] = (rank + 1) * (i + round);
        MPI_Allreduce(mine, sum, REDUCE_LEN, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        MPI_Allreduce(mine, top, REDUCE_LEN, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
        for (long i = 0; i < REDUCE_LEN; i++) {
            if (sum[i] != ranks_sum * (i + round) || top[i] != (long)size * (i + round)) {
                fprintf(stderr,
                        "rank %d: allreduce round %d element %ld: sum %ld (not %ld), max %ld (not %ld)\n",
                        rank, round, i, sum[i], ranks_sum * (i + round), top[i],
                        (long)size * (i + round));
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
        }
    }

    MPI_Barrier(MPI_COMM_WORLD);
    printf("rank %d of %d partner %d OK\n", rank, size, partner);
    free(out);
    free(in);
    free(mine);
    free(sum);
    free(top);
    MPI_Finalize();
    return 0;
}
