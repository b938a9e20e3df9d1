"""fla's own GLAForCausalLM forward on a CPU, for tests: `python fla_cpu_forward.py CKPT TOKENS OUT`.

fla's GLA layers, norms and RoPE are Triton kernels; Triton's interpreter (TRITON_INTERPRET=1, set
here before anything imports triton) runs them on the CPU with numpy. Two things the interpreter
lacks are supplied: a GPU driver for the autotuner's benchmark (each autotuned kernel keeps its
first config, so nothing is benchmarked) and flash-attn, for fla's Attention (hf_fixture's exact
torch transcription of flash_attn_func). TOKENS and OUT are safetensors files ({"tokens"} in,
{"logits"} out, fp32).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.autotuner as autotuner  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

_run = autotuner.Autotuner.run


def _first_config(self, *args, **kwargs):
    self.configs = self.configs[:1]  # one config: the autotuner runs it without benchmarking
    return _run(self, *args, **kwargs)


autotuner.Autotuner.run = _first_config


def main(ckpt: str, tokens_path: str, out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fla  # noqa: F401  (registers GLA with transformers' Auto classes)
    from transformers import AutoModelForCausalLM

    from hf_fixture import fla_attention_on_cpu

    tokens = load_file(tokens_path)["tokens"]
    with fla_attention_on_cpu():
        model = AutoModelForCausalLM.from_pretrained(ckpt).float().eval()
        with torch.no_grad():
            logits = model(tokens).logits.float()
    save_file({"logits": logits.contiguous()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
