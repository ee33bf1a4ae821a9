#!/usr/bin/env python3
"""Records real firn traffic for the fuzz seed corpus: a relay between the enricher and
the sampler's socket that writes each connection's bytes in both directions
(conn-N.c2s, conn-N.s2c) and passes SCM_RIGHTS fds through, so the broker works.

  sudo python3 fuzz/capture.py SAMPLER_SOCKET RELAY_SOCKET OUT_DIR
"""
import os
import selectors
import socket
import sys


def main():
    target, listen, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    if os.path.exists(listen):
        os.unlink(listen)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(listen)
    os.chmod(listen, 0o666)
    srv.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ, None)
    n = 0
    while True:
        for key, _ in sel.select():
            if key.data is None:
                client, _ = srv.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                upstream.connect(target)
                n += 1
                c2s = open(os.path.join(out, f"conn-{n}.c2s"), "wb")
                s2c = open(os.path.join(out, f"conn-{n}.s2c"), "wb")
                sel.register(client, selectors.EVENT_READ, (upstream, c2s))
                sel.register(upstream, selectors.EVENT_READ, (client, s2c))
                continue
            src = key.fileobj
            dst, log = key.data
            try:
                data, fds, _, _ = socket.recv_fds(src, 1 << 16, 16)
            except OSError:
                data, fds = b"", []
            if not data:
                sel.unregister(src)
                src.close()
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                log.close()
                continue
            log.write(data)
            log.flush()
            try:
                if fds:
                    socket.send_fds(dst, [data], fds)
                else:
                    dst.sendall(data)
            except OSError:
                pass  # the other side is gone; its end of the relay closes next
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    main()
