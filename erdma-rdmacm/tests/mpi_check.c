/*
 * An MPI job for the drop-ins (scripts/test-dropin fabric): two ranks exchange messages of
 * 1 B to 4 MiB and sum vectors, every byte checked, then time 1000 round trips of 8 bytes.
 * Prints "mpi_check: N ranks, B bad, ..." on rank 0; exits 1 when a byte or a sum was wrong.
 * Run under Open MPI's OFI MTL on libfabric's verbs;ofi_rxm, which runs on the drop-in
 * libibverbs and librdmacm.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static unsigned char pattern(size_t i, int rank, size_t len)
{
	return (unsigned char)(i * 7 + (size_t)rank * 13 + len);
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	int bad = 0;
	int peer = rank ^ 1;
	for (size_t len = 1; size == 2 && len <= (4u << 20); len *= 4) {
		unsigned char *s = malloc(len), *d = malloc(len);
		size_t m = len / 8 ? len / 8 : 1;
		double *a = malloc(m * sizeof(double)), *b = malloc(m * sizeof(double));
		if (!s || !d || !a || !b)
			MPI_Abort(MPI_COMM_WORLD, 2);
		for (size_t i = 0; i < len; i++)
			s[i] = pattern(i, rank, len);
		MPI_Sendrecv(s, (int)len, MPI_BYTE, peer, 1, d, (int)len, MPI_BYTE, peer, 1,
			     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		for (size_t i = 0; i < len; i++)
			if (d[i] != pattern(i, peer, len)) {
				bad++;
				break;
			}
		for (size_t i = 0; i < m; i++)
			a[i] = (double)i + rank;
		MPI_Allreduce(a, b, (int)m, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
		for (size_t i = 0; i < m; i++)
			if (b[i] != 2.0 * (double)i + 1) {
				bad++;
				break;
			}
		free(s);
		free(d);
		free(a);
		free(b);
	}
	char x[8] = { 0 };
	double t = MPI_Wtime();
	for (int i = 0; size == 2 && i < 1000; i++) {
		if (rank == 0) {
			MPI_Send(x, 8, MPI_BYTE, 1, 2, MPI_COMM_WORLD);
			MPI_Recv(x, 8, MPI_BYTE, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		} else {
			MPI_Recv(x, 8, MPI_BYTE, 0, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			MPI_Send(x, 8, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
		}
	}
	t = MPI_Wtime() - t;
	int all = 0;
	MPI_Allreduce(&bad, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
	if (size != 2)
		all++;
	if (rank == 0)
		printf("mpi_check: %d ranks, %d bad, 8 B half round trip %.2f us\n", size, all,
		       t / 2000 * 1e6);
	MPI_Finalize();
	return all != 0;
}
