"""A tiny GLM-5 checkpoint WITH one MTP layer, the way SGLang 0.5.23's loader reads it: the probe
behind docs/glm.md ("MTP (speculative decoding) on CPU").

It copies the tests' tiny random GLM-5 checkpoint (tests/tiny_model.py, 2 layers, no MTP layer)
and adds ``model.layers.2.*`` (``num_hidden_layers`` 2): a copy of decoder layer 1 (MLA, indexer,
MoE) plus the MTP parts transformers has no module for: ``enorm``, ``hnorm``, ``eh_proj``
[hidden, 2 x hidden], ``shared_head.norm`` and ``shared_head.head`` (SGLang skips the head and
uses the target's ``lm_head``: deepseek_weight_loader.py:327). ``num_nextn_predict_layers`` 1.

    .venv/bin/python scripts/glm_mtp_checkpoint.py /tmp/glm-mtp
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_model import tiny_random_glm_dsa


def build(out: Path) -> Path:
    src = tiny_random_glm_dsa()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    weights = load_file(src / "model.safetensors")
    torch.manual_seed(1)
    hidden = cfg["hidden_size"]
    mtp = f"model.layers.{n}."
    last = f"model.layers.{n - 1}."
    for name, value in list(weights.items()):
        if name.startswith(last):
            weights[mtp + name[len(last) :]] = value.clone()
    weights[mtp + "enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    weights[mtp + "hnorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    eh = torch.randn(hidden, 2 * hidden) * cfg["initializer_range"]
    weights[mtp + "eh_proj.weight"] = eh.to(torch.bfloat16)
    weights[mtp + "shared_head.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    weights[mtp + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/glm-mtp")))
