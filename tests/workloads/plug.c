// Shared library for the dlopen test: plug_spin is the hot function.
__attribute__((noinline)) unsigned long plug_leaf(unsigned long x)
{
	for (int i = 0; i < 100000; i++) {
		x = x * 6364136223846793005UL + 1442695040888963407UL;
		__asm__ volatile("" : "+r"(x));
	}
	return x;
}

unsigned long plug_spin(unsigned long x, long rounds)
{
	for (long i = 0; i < rounds; i++)
		x = plug_leaf(x);
	return x;
}
