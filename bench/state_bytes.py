"""The guard's memory at a given geometry, computed without allocating it (meta tensors).

    python -m kvguard.bench.state_bytes                      # the two reference geometries
    python -m kvguard.bench.state_bytes --slots 1500000 --page-size 1 --rows 2048 \\
        --context 131072 --kv-bytes-per-token 65536

Counts what the guard keeps per page (the ledger), per row (the records) and the compiled CPU
backend's two step workspaces, against the KV pool's bytes; SGLang's own page table
(``req_to_token``, int32 rows x context) is printed beside it for scale.
"""

from __future__ import annotations

import argparse

from kvguard.kernels.guard_state import (
    TRITON_WORKSPACE_BYTES_PER_PAGE,
    WORKSPACE_BYTES_PER_PAGE,
    PageArrays,
    RowArrays,
)

GEOMETRIES = {
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x (K, V) x 1 byte (FP8) = 64 KiB per token
    "llama-3.1-8b-fp8": dict(
        slots=1_500_000, page_size=1, rows=2048, context=131_072, kv_bytes_per_token=65_536
    ),
    # Kimi K2 (DeepSeek-V3 MLA): 61 layers x (512 latent + 64 rope) x 1 byte (FP8)
    "kimi-k2-mla-fp8": dict(
        slots=1_370_000, page_size=64, rows=512, context=262_144, kv_bytes_per_token=61 * 576
    ),
}


def guard_bytes(slots: int, page_size: int, rows: int) -> dict[str, int]:
    pages = (slots + page_size - 1) // page_size
    ledger = PageArrays.empty(pages, "meta").nbytes()
    records = RowArrays.empty(rows, "meta").nbytes()
    workspace = pages * WORKSPACE_BYTES_PER_PAGE
    return {"pages": pages, "ledger": ledger, "records": records, "workspace": workspace,
            "total": ledger + records + workspace}  # fmt: skip


def report(
    name: str, slots: int, page_size: int, rows: int, context: int, kv_bytes_per_token: int
) -> str:
    g = guard_bytes(slots, page_size, rows)
    cuda = g["ledger"] + g["records"] + g["pages"] * TRITON_WORKSPACE_BYTES_PER_PAGE
    pool = slots * kv_bytes_per_token
    table = rows * context * 4
    mib = lambda n: f"{n / 2**20:,.1f} MiB"
    return (
        f"{name}: {slots:,} slots x {kv_bytes_per_token:,} B = {pool / 2**30:,.2f} GiB of KV, "
        f"page {page_size} ({g['pages']:,} pages), {rows:,} rows x {context:,} context\n"
        f"  guard: ledger {mib(g['ledger'])} + records {mib(g['records'])} + CPU workspace "
        f"{mib(g['workspace'])} = {mib(g['total'])} = {100 * g['total'] / pool:.3f}% of the KV pool\n"
        f"  on a CUDA pool (Triton backend, {TRITON_WORKSPACE_BYTES_PER_PAGE} B/page of scratch): "
        f"{mib(cuda)} = {100 * cuda / pool:.3f}%\n"
        f"  (SGLang's req_to_token at this geometry: {mib(table)} = {100 * table / pool:.2f}%)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--slots", type=int)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--context", type=int, default=131_072)
    ap.add_argument("--kv-bytes-per-token", type=int, default=65_536)
    a = ap.parse_args(argv)
    if a.slots:
        print(report("custom", a.slots, a.page_size, a.rows, a.context, a.kv_bytes_per_token))
    else:
        for name, geo in GEOMETRIES.items():
            print(report(name, **geo))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
