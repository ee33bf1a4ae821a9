#!/usr/bin/env python3
"""A STAND-IN for OpenSearch, for firn's tests only: no OpenSearch server can run on
these machines. It plays the documented HTTP API firn's sink uses and nothing more:

- GET/PUT /_index_template/<name>: 404 until a template is put; a put template must have
  index_patterns, `dynamic: strict` mappings, and a type for every property.
- POST /_bulk (NDJSON): every line must parse; lines must pair an action
  ({"index": {"_index", "_id"}}) with a document; the index must match an installed
  template's pattern. An index is made at its first document with the mappings of
  that template as they are then, and keeps them (as OpenSearch: a later template
  changes only indices made after it); every document field must be mapped by its
  index, with a value of the mapped type (keyword: string or list of strings, long: integer, date: integer
  epoch_millis, object: object; labels.*: strings). Documents are stored by _id (an
  index action overwrites), and the answer has one item per action, as OpenSearch's.
- PUT /<index or pattern,…>/_mapping: adds properties to the matching indices; a
  property already mapped with another type is refused (400), as OpenSearch does.
- Basic auth: with --user/--password, a request without that Authorization header gets
  401 (and is counted).

Faults on request: --huge-answers N answers the first N _bulk calls with 1.5 GiB of
JSON (a hostile or broken server: the client must read no more than its bound); --bulk-429 N answers the first N _bulk calls with 429; --mixed
answers per item: a first try of some documents 429 (retried by the client), some stack
documents 400 mapper_parsing_exception (dropped by the client), the rest 201.

--old-template FILE installs FILE as the template `firn-profiles` at start and makes
today's and tomorrow's (UTC) index from it: what an enricher of an older mapping left.

Writes OUT/state.json after every request: the template, the documents by id, the
counts, and any violations of the checks above (which the tests expect to be none).
"""

import argparse
import base64
import copy
import datetime
import fnmatch
import hashlib
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATE = {
    "templates": {},
    "indices": {},
    "docs": {},
    "counts": {"bulk_calls": 0, "bulk_429": 0, "items": 0, "item_429": 0,
               "item_400": 0, "unauthorized": 0, "template_gets": 0, "template_puts": 0,
               "mapping_puts": 0},
    "rejected_ids": [],
    "violations": [],
}
SEEN_429 = set()


def h(s, mod):
    return int(hashlib.md5(s.encode()).hexdigest(), 16) % mod


def check_value(path, value, mapping, violations):
    ty = mapping.get("type", "object" if "properties" in mapping or "dynamic" in mapping else None)
    if ty == "keyword":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    elif ty in ("long", "integer"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif ty == "date":
        ok = isinstance(value, int) and mapping.get("format") == "epoch_millis"
    elif ty == "object":
        if isinstance(value, list):
            for v in value:
                check_value(path, v, mapping, violations)
            return
        ok = isinstance(value, dict)
        if ok and "properties" in mapping:
            for k, v in value.items():
                sub = mapping["properties"].get(k)
                if sub is None:
                    violations.append(f"{path}.{k}: not mapped")
                else:
                    check_value(f"{path}.{k}", v, sub, violations)
            return
        if ok and path == "labels":
            for k, v in value.items():
                if not isinstance(v, str):
                    violations.append(f"labels.{k}: not a string")
            return
    else:
        violations.append(f"{path}: mapping without a known type: {mapping}")
        return
    if not ok:
        violations.append(f"{path}: {value!r} is not a {ty}")


def check_doc(doc, mappings, violations):
    props = mappings["properties"]
    for k, v in doc.items():
        if k not in props:
            violations.append(f"{k}: not mapped (the index's mapping is strict)")
            continue
        check_value(k, v, props[k], violations)


def check_template(t, violations):
    m = t.get("template", {}).get("mappings", {})
    if not t.get("index_patterns"):
        violations.append("template: no index_patterns")
    if m.get("dynamic") != "strict":
        violations.append("template: mappings are not dynamic: strict")
    props = m.get("properties", {})
    if not props:
        violations.append("template: no properties")

    def walk(p, mp):
        for k, v in mp.items():
            if "type" not in v and "properties" not in v:
                violations.append(f"template: {p}{k} has no type")
            if "properties" in v:
                walk(f"{p}{k}.", v["properties"])
    walk("", props)
    for need in ("@timestamp", "labels", "samples", "cpu_ns", "frames", "doc_type"):
        if need not in props:
            violations.append(f"template: {need} not mapped")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def authorized(self):
        if not ARGS.user:
            return True
        want = "Basic " + base64.b64encode(f"{ARGS.user}:{ARGS.password}".encode()).decode()
        if self.headers.get("authorization") == want:
            return True
        STATE["counts"]["unauthorized"] += 1
        self.reply(401, {"error": {"type": "security_exception", "reason": "unauthorized"}, "status": 401})
        return False

    def body(self):
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n)

    def do_GET(self):
        with LOCK:
            body = self.body()
            if not self.authorized():
                return save()
            if self.path.startswith("/_index_template/"):
                STATE["counts"]["template_gets"] += 1
                name = self.path.split("/")[2]
                t = STATE["templates"].get(name)
                if t is None:
                    self.reply(404, {"error": {"type": "resource_not_found_exception"}, "status": 404})
                else:
                    self.reply(200, {"index_templates": [{"name": name, "index_template": t}]})
            else:
                self.reply(404, {"error": "stand-in: not played"})
            save()

    def do_PUT(self):
        with LOCK:
            body = self.body()
            if not self.authorized():
                return save()
            if self.path.endswith("/_mapping"):
                return self.put_mapping(body)
            if self.path.startswith("/_index_template/"):
                STATE["counts"]["template_puts"] += 1
                name = self.path.split("/")[2]
                try:
                    t = json.loads(body)
                except ValueError as e:
                    STATE["violations"].append(f"template: not JSON: {e}")
                    self.reply(400, {"error": "bad json"})
                    return save()
                check_template(t, STATE["violations"])
                STATE["templates"][name] = t
                self.reply(200, {"acknowledged": True})
            else:
                self.reply(404, {"error": "stand-in: not played"})
            save()

    def put_mapping(self, body):
        STATE["counts"]["mapping_puts"] += 1
        patterns = self.path.split("/")[1].split(",")
        try:
            props = json.loads(body)["properties"]
        except (ValueError, KeyError, TypeError) as e:
            STATE["violations"].append(f"_mapping: not a properties object: {e}")
            self.reply(400, {"error": "bad mapping"})
            return save()
        names = [i for i in STATE["indices"] if any(fnmatch.fnmatch(i, p) for p in patterns)]
        for i in names:
            have = STATE["indices"][i]["properties"]
            for k, v in props.items():
                if k in have and have[k].get("type") != v.get("type"):
                    self.reply(400, {"error": {"type": "illegal_argument_exception",
                                               "reason": f"mapper [{k}] cannot be changed"}})
                    return save()
        for i in names:
            STATE["indices"][i]["properties"].update(copy.deepcopy(props))
        self.reply(200, {"acknowledged": True})
        save()

    def huge(self):
        """1.5 GiB of an answer that never ends being valid JSON, until the client hangs up."""
        size = 3 << 29
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(size))
        self.end_headers()
        chunk = b'{"items": [' + b'{"index": {"status": 201}},' * 37000
        sent = 0
        try:
            while sent < size:
                part = chunk[: size - sent]
                self.wfile.write(part)
                sent += len(part)
        except (BrokenPipeError, ConnectionResetError):
            pass
        with_lock = STATE["counts"]
        with_lock["huge_bytes_sent"] = with_lock.get("huge_bytes_sent", 0) + sent

    def do_POST(self):
        with LOCK:
            body = self.body()
            if not self.authorized():
                return save()
            if self.path != "/_bulk":
                self.reply(404, {"error": "stand-in: not played"})
                return save()
            c = STATE["counts"]
            c["bulk_calls"] += 1
            if self.headers.get("content-type") != "application/x-ndjson":
                STATE["violations"].append(f"_bulk content-type {self.headers.get('content-type')}")
            if c["bulk_calls"] <= ARGS.huge_answers:
                c["huge_answers"] = c.get("huge_answers", 0) + 1
                save()
                return self.huge()
            if c["bulk_calls"] <= ARGS.bulk_429:
                c["bulk_429"] += 1
                self.reply(429, {"error": {"type": "es_rejected_execution_exception"}, "status": 429})
                return save()
            lines = body.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            else:
                STATE["violations"].append("_bulk body does not end with a newline")
            if len(lines) % 2:
                STATE["violations"].append(f"_bulk with an odd number of lines ({len(lines)})")
            items = []
            for i in range(0, len(lines) - 1, 2):
                try:
                    action = json.loads(lines[i])
                    doc = json.loads(lines[i + 1])
                except ValueError as e:
                    STATE["violations"].append(f"_bulk line {i}: not JSON: {e}")
                    items.append({"index": {"status": 400, "error": {"type": "parse_exception", "reason": str(e)}}})
                    continue
                if list(action) != ["index"] or set(action["index"]) != {"_index", "_id"}:
                    STATE["violations"].append(f"_bulk line {i}: unexpected action {action}")
                meta = action.get("index", {})
                index, _id = meta.get("_index", ""), meta.get("_id", "")
                templates = [t for t in STATE["templates"].values()
                             if any(fnmatch.fnmatch(index, p) for p in t.get("index_patterns", []))]
                if index not in STATE["indices"] and templates:
                    STATE["indices"][index] = copy.deepcopy(templates[0]["template"]["mappings"])
                if index not in STATE["indices"]:
                    STATE["violations"].append(f"{index}: no template matches (installed first?)")
                else:
                    check_doc(doc, STATE["indices"][index], STATE["violations"])
                c["items"] += 1
                if ARGS.mixed and h(_id, 5) == 0 and _id not in SEEN_429:
                    SEEN_429.add(_id)
                    c["item_429"] += 1
                    items.append({"index": {"_index": index, "_id": _id, "status": 429,
                                            "error": {"type": "es_rejected_execution_exception", "reason": "queue full"}}})
                    continue
                if ARGS.mixed and doc.get("doc_type") == "stack" and h(_id, 11) == 0:
                    c["item_400"] += 1
                    STATE["rejected_ids"].append(_id)
                    items.append({"index": {"_index": index, "_id": _id, "status": 400,
                                            "error": {"type": "mapper_parsing_exception", "reason": "stand-in refusal"}}})
                    continue
                created = _id not in STATE["docs"]
                STATE["docs"][_id] = dict(doc, _index=index)
                items.append({"index": {"_index": index, "_id": _id, "status": 201 if created else 200,
                                        "result": "created" if created else "updated"}})
            errors = any(it["index"]["status"] >= 300 for it in items)
            self.reply(200, {"took": 1, "errors": errors, "items": items})
            save()


def save():
    # Documents answered 429 that have not come back yet (the client's retry pending).
    STATE["pending_retry"] = sum(1 for i in SEEN_429 if i not in STATE["docs"] and i not in STATE["rejected_ids"])
    tmp = os.path.join(ARGS.out, ".state.json")
    with open(tmp, "w") as f:
        json.dump(STATE, f)
    os.replace(tmp, os.path.join(ARGS.out, "state.json"))


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--user")
    p.add_argument("--password")
    p.add_argument("--bulk-429", type=int, default=0)
    p.add_argument("--huge-answers", type=int, default=0)
    p.add_argument("--mixed", action="store_true")
    p.add_argument("--old-template")
    ARGS = p.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    if ARGS.old_template:
        t = json.load(open(ARGS.old_template))
        STATE["templates"]["firn-profiles"] = t
        today = datetime.datetime.now(datetime.timezone.utc).date()
        for d in (today, today + datetime.timedelta(days=1)):
            STATE["indices"][f"firn-profiles-{d:%Y.%m.%d}"] = copy.deepcopy(t["template"]["mappings"])
    save()
    srv = ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler)
    print(f"listening on 127.0.0.1:{ARGS.port} (OpenSearch stand-in)", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
