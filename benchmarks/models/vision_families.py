"""Training throughput and peak memory of the two vision-language families
``integrations.transformers.patch`` supports, Qwen2-VL and Qwen2.5-VL (issue 23's table, its
vision rows): plain PyTorch, polykernel, Liger-Kernel and ``torch.compile``, each variant of each
family in a fresh process of its own, as ``families.py`` runs the text families (its machinery:
``_common.family_child`` and ``_common.run_families``).

A step is a forward with labels over a batch of sequences that each hold one image (the vision
tower, its merger, the language model and its causal-LM loss), the backward and an AdamW step, on a
randomly initialised model built from the transformers config classes (nothing is downloaded),
bf16 weights on CUDA. The shapes: Qwen2-VL-2B's widths and Qwen2.5-VL-3B's, each cut to 8 language
layers and 8 vision blocks; 4 sequences of 1024 tokens, each with one 448×448 image (32×32 patches
of 14, 256 tokens once merged 2×2) after 8 text tokens. The record of a run: median step time of the
timed steps, tokens/s (all the sequences' tokens, the image's among them), peak CUDA memory
(allocated), the first step's loss (the variants start from the same weights and batch), and what
polykernel ran.

    # the H200 rows (one family a part in benchmarks/h200_plan.sh)
    python benchmarks/models/vision_families.py --families qwen2_vl --steps 6 --warmup 3 --json /tmp/vision.json
    # a quick check of the script on the CPU (tiny shapes: 2 layers, an 8×8 image of 2×2 patches)
    python benchmarks/models/vision_families.py --tiny --variants plain,polykernel --steps 1 --warmup 1 --json /tmp/vision.json

Liger's VL patches follow transformers' modeling code closely: where the installed transformers has
moved on, the Liger row records the error and the other rows go on.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # this folder's helpers: one variant per process, the family runs
import _common

from polykernel.tools.rows import RowFile, announce

# Qwen's special ids (the tiny vocabulary's are its last ids)
IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
TEXT_IDS = 151643  # ordinary tokens are drawn below this (the special ids start here)
TEXT = dict(  # the language model at Qwen2-VL-2B's widths, 8 of its 28 layers
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    bos_token_id=151643,
    eos_token_id=151645,
)
PATCHES = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_heads=16)
TINY_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_IDS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
TINY_PATCHES = dict(patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_heads=2)

# family -> (config class, model class, text overrides, vision config, tiny text overrides, tiny vision config)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {"tie_word_embeddings": True},
        dict(depth=8, embed_dim=1280, hidden_size=1536, mlp_ratio=4, **PATCHES),  # hidden_size: the merger's output
        {},
        dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, **TINY_PATCHES),
    ),
    "qwen2_5_vl": (  # Qwen2.5-VL-3B's widths: 8 of its 36 language layers and of its 32 vision blocks
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        {"hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16, "tie_word_embeddings": True},
        dict(
            depth=8,
            hidden_size=1280,
            intermediate_size=3420,
            out_hidden_size=2048,
            window_size=112,
            fullatt_block_indexes=[3, 7],  # 3B's [7, 15, 23, 31]: every fourth block attends over the whole image
            **PATCHES,
        ),
        {},
        dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=8, fullatt_block_indexes=[1], **TINY_PATCHES),
    ),
}
IMAGE_SIDE, TINY_IMAGE_SIDE = 448, 8  # pixels (square images)
TEXT_BEFORE = 8  # text tokens before each sequence's image


def config_for(family: str, tiny: bool) -> Any:
    import transformers

    config_name, _, text, vision, tiny_text, tiny_vision = FAMILIES[family]
    text_config = {**TINY_TEXT, **tiny_text} if tiny else {**TEXT, **text}
    tie = text_config.pop("tie_word_embeddings", False)
    return getattr(transformers, config_name)(
        text_config=text_config, vision_config=tiny_vision if tiny else vision, tie_word_embeddings=tie, **(TINY_IDS if tiny else IDS)
    )


def batch_for(config: Any, tiny: bool, batch: int, seq: int, device: Any, dtype: Any) -> dict[str, Any]:
    """``batch`` sequences of ``seq`` tokens, each: ``TEXT_BEFORE`` text tokens, the image's
    (between its start and end tokens), text to the end; the image's patches (seeded noise), the
    grids, the token types; labels the ids, the image's tokens masked."""
    import torch

    vision = config.vision_config
    side = TINY_IMAGE_SIDE if tiny else IMAGE_SIDE
    grid = side // vision.patch_size
    image_tokens = grid * grid // vision.spatial_merge_size**2
    if TEXT_BEFORE + image_tokens + 3 > seq:
        raise ValueError(f"--seq {seq} holds no image of {image_tokens} tokens")
    gen = torch.Generator().manual_seed(1)
    text_ids = min(config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    ids = torch.randint(3, min(text_ids, TEXT_IDS), (batch, seq), generator=gen)
    first = TEXT_BEFORE + 1
    ids[:, TEXT_BEFORE] = config.vision_start_token_id
    ids[:, first : first + image_tokens] = config.image_token_id
    ids[:, first + image_tokens] = config.vision_end_token_id
    labels = ids.clone()
    labels[:, TEXT_BEFORE : first + image_tokens + 1] = -100
    token_types = torch.zeros_like(ids)
    token_types[:, first : first + image_tokens] = 1
    patch_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * grid * grid, patch_width, generator=gen)
    grids = torch.tensor([[1, grid, grid]] * batch)
    return dict(
        input_ids=ids.to(device),
        labels=labels.to(device),
        pixel_values=pixels.to(device, dtype),
        image_grid_thw=grids.to(device),
        mm_token_type_ids=token_types.to(device),
    )


def build(family: str, tiny: bool, seq: int, batch: int, device: Any, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """The randomly initialised ``family`` model and its batch (:func:`batch_for`)."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = config_for(family, tiny)
    with torch.device(device):  # initialised on the device, as families.py's models
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    if type(model).__name__ != FAMILIES[family][1]:
        raise TypeError(f"{family}: built {type(model).__name__}, not {FAMILIES[family][1]}")
    return model, batch_for(config, tiny, batch, seq, device, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = dict(batch="sequences (one image each) per step (default 4; tiny: 2)", seq="tokens per sequence (default 1024; tiny: 32)")
    _common.add_family_args(parser, list(FAMILIES), **sizes)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 1024)
    if args.child:
        _child.emit(_common.family_child(args, lambda family, device, dtype: build(family, args.tiny, args.seq, args.batch, device, dtype)))
        return
    families, variants = _common.family_selection(parser, args, FAMILIES)
    argv, setup = _common.family_argv(args)
    setup["image_side"] = TINY_IMAGE_SIDE if args.tiny else IMAGE_SIDE
    out = RowFile(args.json, {"setup": setup})  # each run's record kept as it ends (a cut run keeps them)
    announce(len(families) * len(variants), per_case_s=8 if args.tiny else 90, what="runs", path=args.json)
    summary = _common.run_families(__file__, families, variants, argv, args.timeout, out)
    out.finish(summary=summary)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
