"""Reader-held records: what each request row expects of the KV it reads.

Like a ZFS block pointer, the expected epoch of each logical page and the expected digest and
token chain of each position live with the reader (the request's row), never with the page, so
whoever writes a page next cannot refresh them. Rows are SGLang's ``req_to_token`` rows.
"""

from __future__ import annotations

import torch


class RowRecords:
    def __init__(self, num_rows: int, max_len: int, page_size: int, device):
        d = torch.device(device)
        self.page_size = page_size
        self.max_len = max_len
        max_pages = (max_len + page_size - 1) // page_size
        self.epoch = torch.zeros(num_rows, max_pages, dtype=torch.int64, device=d)
        self.chain = torch.zeros(num_rows, max_len, dtype=torch.int64, device=d)
        self.digest = torch.zeros(num_rows, max_len, dtype=torch.int64, device=d)
        self.sealed = torch.zeros(num_rows, max_len, dtype=torch.bool, device=d)
