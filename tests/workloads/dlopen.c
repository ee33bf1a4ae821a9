// Waits argv[2] seconds, then dlopens argv[1] and spins in its plug_spin for argv[3]
// seconds: the library's mappings appear after the process was first recorded.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) static void wait_busy(double secs)
{
	double end = now() + secs;
	volatile unsigned long x = 0;
	while (now() < end)
		x++;
}

int main(int argc, char **argv)
{
	if (argc < 4)
		return 2;
	printf("ready %d\n", getpid());
	fflush(stdout);
	wait_busy(atof(argv[2]));
	void *h = dlopen(argv[1], RTLD_NOW);
	if (!h) {
		fprintf(stderr, "dlopen: %s\n", dlerror());
		return 1;
	}
	unsigned long (*spin)(unsigned long, long) = (unsigned long (*)(unsigned long, long))dlsym(h, "plug_spin");
	double end = now() + atof(argv[3]);
	unsigned long x = 1;
	while (now() < end)
		x = spin(x, 10);
	printf("loaded %lu\n", x & 1);
	return 0;
}
