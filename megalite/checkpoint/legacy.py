"""Format-2 checkpoints (the previous release: full tensors per pipeline stage): their
weights load through an index built from the files' headers.
"""
import os

from safetensors import safe_open

from megalite.checkpoint.files import safetensors_shapes


def model_file(directory: str, pp_rank: int, ep_rank: int = 0) -> str:
    """A format-2 checkpoint's weights of stage `pp_rank`; for EP rank > 0 only its experts."""
    ep = f"_ep{ep_rank:03d}" if ep_rank else ""
    return os.path.join(directory, f"model_pp{pp_rank:03d}{ep}.safetensors")



def model_files(directory: str, layout: dict) -> list[str]:
    """Every model file of a format-2 checkpoint saved under `layout` ("pp", optional "ep")."""
    return [model_file(directory, stage, ep_rank) for stage in range(layout["pp"])
            for ep_rank in range(layout.get("ep", 1))]



_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
                       "I64": "int64", "I32": "int32"}



def legacy_index(directory: str, meta: dict) -> dict:
    """The index of a format-2 checkpoint: its per-stage model files hold full tensors."""
    model = {}
    for path in model_files(directory, meta["layout"]):
        safetensors_shapes(path)
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                shape = piece.get_shape()
                model[key] = {"shape": shape, "dtype": _SAFETENSORS_DTYPES[piece.get_dtype()],
                              "pieces": [[os.path.basename(path), key, [0] * len(shape), shape]]}
    return {"model": model, "scalars": {}}
