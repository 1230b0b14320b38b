"""The engine's llama.cpp build carries a batch-invariant CPU attention kernel (tools/llama_cpp/edgellm.patch,
on by default: ModelConfig.batch_invariant): a sequence's logits must be bit-identical wherever its cells
sit in the pool and whatever else its steps decode. tools/kv_layout_check.py is the check (it also
reports llama.cpp's own kernels, which differ); here its cases run on the default config only."""

from __future__ import annotations

import argparse
import logging

from edgellm.engine.config import ModelConfig
from edgellm.engine.model import LlamaModel
from tools.kv_layout_check import check


def test_logits_do_not_depend_on_placement_neighbours_or_batch_shape(model_path, capsys):
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    config = ModelConfig(path=model_path, n_ctx=2048, n_slots=4)
    assert config.kv_unified and config.batch_invariant  # the defaults under test
    # the cases: after another sequence's cells, a hole before its cells, beside another sequence in every
    # step, prompt + continuation re-fed in one batch (a preempted request's resume); each against alone
    same = check(LlamaModel(config), argparse.Namespace(kv="f16", no_flash_attn=False))
    out = capsys.readouterr().out
    assert same, out
    assert out.count("largest logit difference 0.000000") == 4, out
