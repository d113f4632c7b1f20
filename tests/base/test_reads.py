"""jaxcert.base.reads: the bytes of HLO types, a gather's discount, and bad arguments."""

import jax
import jax.numpy as jnp
import pytest

from jaxcert.base import reads


@pytest.mark.parametrize(
    "hlo_type, size",
    [("f32[64,151936]{1,0}", 64 * 151936 * 4), ("bf16[3]", 6), ("pred[9]", 9), ("s32[]", 4),
     ("f8e4m3fn[10]", 10), ("f4e2m1fn[3]", 2), ("c64[2]", 16), ("(f32[2], s32[])", None)],
)  # fmt: skip
def test_bytes_of_hlo_types(hlo_type, size):
    assert reads._bytes(hlo_type) == size


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_gather_is_charged_what_it_gathers(dtype):
    """64 rows of 16 groups of 64 out of 8192 tokens: 1/8 of the logits, read and written."""
    x = jax.ShapeDtypeStruct((64, 8192), dtype)
    ids = jax.ShapeDtypeStruct((64, 16), jnp.int32)

    def gather(a, i):
        return jnp.take_along_axis(a.reshape(64, 128, 64), i[..., None], axis=-2)

    got = reads.input_reads(gather, x, ids)
    assert got.xla > 1.0  # XLA charges the whole operand
    out = 16 * 64 / 8192 * 4 / jnp.dtype(dtype).itemsize  # the float32 output
    assert got.gathered < 2 * out + 0.02


def test_a_plain_pass_is_one_read_each_way():
    x = jax.ShapeDtypeStruct((8, 4096), jnp.float32)
    got = reads.input_reads(lambda a: a * 2.0, x)
    assert got == (pytest.approx(2.0, abs=1e-6), pytest.approx(2.0, abs=1e-6))


@pytest.mark.parametrize(
    "args, of, message",
    [((jax.ShapeDtypeStruct((2,), jnp.float32),), 1, "names no argument"),
     ((jax.ShapeDtypeStruct((2,), jnp.float32),) * 2, True, "names no argument"),
     ((3.0,), 0, "no array"),
     ((jax.ShapeDtypeStruct((0, 5), jnp.float32),), 0, "empty")],
)  # fmt: skip
def test_bad_arguments_are_named(args, of, message):
    with pytest.raises(ValueError, match=message):
        reads.input_reads(lambda *a: a[0], *args, of=of)
