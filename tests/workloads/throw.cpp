// C++ exceptions in flight, for the unwinding tests: main -> thrower -> deep_throw
// throws, main catches, for argv[1] seconds; much of the time is spent inside the C++
// runtime's own unwinder (libgcc_s, libstdc++). Built with clang++ -O2 (no frame
// pointers): only the unwind tables walk it.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <unistd.h>

static volatile unsigned long sink;

__attribute__((noinline)) void deep_throw(unsigned long x)
{
	volatile unsigned long pad[4] = {x, x, x, x};
	if (pad[2] != ~0UL)
		throw std::runtime_error("firn");
}

__attribute__((noinline)) unsigned long thrower(unsigned long x)
{
	volatile unsigned long pad[2] = {x, x};
	deep_throw(x + pad[1]);
	return pad[0];
}

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? std::atof(argv[1]) : 10;
	auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
	std::printf("ready %d\n", getpid());
	std::fflush(stdout);
	unsigned long x = 0;
	while (std::chrono::steady_clock::now() < end) {
		for (int i = 0; i < 1000; i++) {
			try {
				x += thrower(x);
			} catch (const std::exception &) {
				x++;
			}
		}
	}
	sink = x;
	return 0;
}
