#!/usr/bin/env python3
"""Makes tests/vectors.json with an implementation independent of ours:
the `xxhash` package from PyPI (the reference C library's binding).

Run: pip install xxhash && python3 make_vectors.py > vectors.json
"""
import json
import struct

import xxhash

PARTITIONS = 4096
LEGAL = [1 << k for k in range(13)]

ids = [1, 2, 3, 42, 1000, -1, -42, 0,
       2**31 - 1, 2**31, 2**53, 2**53 + 1, 2**62,
       2**63 - 1, -(2**63), -(2**63) + 1,
       # snowflake-shaped ids: (ms << 22) | (node << 12) | seq
       (60_000_000_000 << 22) | (1 << 12) | 0,
       (60_000_000_000 << 22) | (1 << 12) | 1,
       (60_000_000_123 << 22) | (1023 << 12) | 4095,
       7_300_000_000_000_000_000]
keys = ["", "a", "tenant-a/order-1", "tenant-b/order-2", "user:42",
        "ünïcödé/キー", "x" * 300]


def row(h):
    return {"hash": str(h), "partition": h % PARTITIONS,
            "shards": {str(n): h % n for n in LEGAL}}


out = {"ids": [], "keys": []}
for i in ids:
    h = xxhash.xxh64_intdigest(struct.pack("<q", i), seed=0)
    out["ids"].append({"id": str(i), **row(h)})
for k in keys:
    h = xxhash.xxh64_intdigest(k.encode("utf-8"), seed=0)
    out["keys"].append({"key": k, **row(h)})
print(json.dumps(out, indent=1, ensure_ascii=False))
