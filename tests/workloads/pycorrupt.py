# A Python process that corrupts its own interpreter state, for tests/tests/python.rs:
# before its hot function first runs, it points that code object's qualname at a bytes
# object, its file name at unmapped memory and its line table into the middle of an
# object, through ctypes (CPython 3.12's layout: the offsets below). The interpreter
# never reads those fields while the function runs; the walk must refuse each. It is
# killed by the test (SIGTERM ends it without the cleanup that would trip on them).
import ctypes
import os
import sys
import time


def corrupted_loop(end):
    x = 0
    while time.time() < end:
        x = (x * 31 + 7) % 1000003
    return x


JUNK = b"J" * 64
code = corrupted_loop.__code__
assert sys.version_info[:2] == (3, 12)
ctypes.c_void_p.from_address(id(code) + 128).value = id(JUNK)
ctypes.c_void_p.from_address(id(code) + 112).value = 0xDEADBEEF000
ctypes.c_void_p.from_address(id(code) + 136).value = id(JUNK) + 8
print("ready", os.getpid(), flush=True)
corrupted_loop(time.time() + float(sys.argv[1]))
