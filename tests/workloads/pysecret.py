# A root Python process with secrets, for the lying-Python-records test: a str and a
# bytes object read from the file named by argv[1] (which it deletes), held by local
# variables of eight nested frames while the innermost spins. Prints "ready PID".
import os
import sys

with open(sys.argv[1]) as f:
    text, hexed = f.read().split()
os.unlink(sys.argv[1])
secret_str = "".join(list(text))
secret_bytes = bytes.fromhex(hexed)


def hold(depth, s, b):
    if depth:
        return hold(depth - 1, s, b)
    x = 0
    while True:
        x = (x + len(s) + len(b)) % 1000003


print("ready", os.getpid(), flush=True)
hold(8, secret_str, secret_bytes)
