"""One copy of the weights in RAM: once a block's tensors are bound (copied into memory of the runtime's
own), their pages of the mmapped file are unmapped from the process (runtime/weights/page_release.py), for GGUF and
safetensors checkpoints; the bound values equal the file's, and reading the file again afterwards gives the same
bytes. Measured with this process's resident pages of the file's mapping (/proc/self/smaps)."""
import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("gguf")

from test_gguf_reader import spec_of, write_gguf  # noqa: E402

from helmc.runtime.weights.bind import bind_layers, open_checkpoint, weight_view  # noqa: E402
from helmc.runtime.weights.page_release import release_pages  # noqa: E402

DIMS = dict(hidden_size=256, intermediate_size=1024)      # gate / up / down 0.5 MiB each in fp16: many whole pages


def mapped_rss(path: str) -> int:
    """Bytes of this process's resident pages in its mappings of `path`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(" " + str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def block_names(spec, layers):
    return [f"model.layers.{i}.{n}" for i in layers for n in (*spec.pre_attn_weight_names(),
                                                            *spec.post_attn_weight_names())]


def check_bound_blocks_leave_the_mapping(ck, spec, path, read):
    layers = range(spec.num_layers)
    names = block_names(spec, layers)
    before = {n: np.array(read(n)) for n in names}                 # every page of every block touched (copies kept)
    touched = mapped_rss(path)
    block_bytes = sum(a.nbytes for a in before.values())
    bound = bind_layers(ck, spec, layers, tvm.cpu())
    left = mapped_rss(path)
    print(f"{path.name}: {block_bytes / 2**20:.2f} MiB of block weights; mapped and resident {touched / 2**20:.2f} "
          f"MiB after reading them, {left / 2**20:.2f} MiB after binding")
    assert touched - left >= 0.9 * block_bytes, (touched, left, block_bytes)
    pre, post = spec.pre_attn_weight_names(), spec.post_attn_weight_names()
    shapes = spec.block_weight_shapes()
    for i, b in zip(layers, bound):            # the bound copies hold the file's values; the file reads them again
        for n, t in zip((*pre, *post), (*b.pre, *b.post)):
            name = f"model.layers.{i}.{n}"
            assert np.array_equal(np.asarray(read(name)), before[name]), name
            want, _ = weight_view(ck, name, shapes[n], spec.weight_type(i, n), spec.dtype)   # as bind_layers took it
            assert np.array_equal(t.numpy().view(np.uint8), np.ascontiguousarray(want).view(np.uint8)), name


def test_gguf_blocks_are_unmapped_once_bound(tmp_path):
    spec = spec_of("qwen3", **DIMS)
    path = tmp_path / "m.gguf"
    write_gguf(path, spec)
    ck = open_checkpoint(str(path), spec)
    check_bound_blocks_leave_the_mapping(ck, spec, path, ck.view)
    ck.close()


def test_safetensors_blocks_are_unmapped_once_bound(tmp_path):
    pytest.importorskip("torch")
    from helmc.model.spec import ModelSpec
    from helmc.testing import make_tiny_model
    make_tiny_model(str(tmp_path), "qwen3", dtype="float16", **DIMS)
    spec = ModelSpec.from_model_dir(str(tmp_path))
    ck = open_checkpoint(str(tmp_path), spec)
    path = tmp_path / "model.safetensors"
    check_bound_blocks_leave_the_mapping(ck, spec, path, ck.view)
    ck.close()


def test_only_whole_pages_inside_the_range_go():
    import mmap
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 8 * page)
    m[:] = bytes(range(256)) * (8 * page // 256)
    assert release_pages(m, 1, 3 * page - 1) == page                 # only page 1 lies wholly inside
    assert release_pages(m, page + 1, 2 * page - 1) == 0              # no whole page inside
    assert release_pages(m, 0, 8 * page) == 8 * page
    assert release_pages(None, 0, 8 * page) == 0
