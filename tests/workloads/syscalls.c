// A tight syscall loop for argv[1] seconds: most samples land in the kernel.
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 10;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	double end = ts.tv_sec + ts.tv_nsec / 1e9 + seconds;
	printf("ready %d\n", getpid());
	fflush(stdout);
	for (;;) {
		for (int i = 0; i < 10000; i++)
			syscall(SYS_getppid);
		clock_gettime(CLOCK_MONOTONIC, &ts);
		if (ts.tv_sec + ts.tv_nsec / 1e9 > end)
			break;
	}
	return 0;
}
