// CPU-bound workload with a four-deep call chain under main:
// main -> chain_a -> chain_b -> chain_c -> chain_leaf, for argv[1] seconds.
// Built by the unwinding tests with plain `gcc -O2` (the distribution default: no frame
// pointers), so that only the unwind tables can walk it. Each level keeps work after
// its call (no tail calls) and a little stack of its own (a real CFA offset).
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;
static double deadline;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) unsigned long chain_leaf(unsigned long x)
{
	for (int i = 0; i < 400000; i++) {
		x = x * 6364136223846793005UL + 1442695040888963407UL;
		__asm__ volatile("" : "+r"(x));
	}
	return x;
}

#define LEVEL(name, callee)                                              \
	__attribute__((noinline)) unsigned long name(unsigned long x)   \
	{                                                                \
		volatile unsigned long pad[4] = { x, x + 1, x + 2, x + 3 }; \
		unsigned long r = callee(x ^ pad[1]);                    \
		__asm__ volatile("" : "+r"(r));                          \
		return r + pad[3];                                       \
	}

LEVEL(chain_c, chain_leaf)
LEVEL(chain_b, chain_c)
LEVEL(chain_a, chain_b)

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 10;
	unsigned long x = 1;

	deadline = now() + seconds;
	printf("ready %d\n", getpid());
	fflush(stdout);
	while (now() < deadline)
		x = chain_a(x);
	sink = x;
	return 0;
}
