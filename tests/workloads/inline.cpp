// C++ workload for the inline-frame test: firn::mix is always inlined into
// firn::Spinner<unsigned long>::run, which the DWARF describes as an inlined call.
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

namespace firn {

__attribute__((always_inline)) inline unsigned long mix(unsigned long x)
{
	for (int i = 0; i < 100000; i++) {
		x = x * 6364136223846793005UL + 1442695040888963407UL;
		__asm__ volatile("" : "+r"(x));
	}
	return x;
}

template <typename T> struct Spinner {
	__attribute__((noinline)) T run(T x, double deadline);
};

static double now()
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

template <typename T> T Spinner<T>::run(T x, double deadline)
{
	while (now() < deadline)
		x = mix(x);
	return x;
}

} // namespace firn

int main(int argc, char **argv)
{
	double secs = argc > 1 ? atof(argv[1]) : 5;
	printf("ready %d\n", getpid());
	fflush(stdout);
	firn::Spinner<unsigned long> s;
	unsigned long r = s.run(1, firn::now() + secs);
	return r == 42 ? 1 : 0;
}
