"""Transformer.tapped_features: the residual stream after chosen blocks (EAGLE-3's input)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcert.models import Transformer
from jaxcert.models.transformer import truncate
from tests.helpers.tiny_models import tiny_config


def test_taps_are_the_residual_stream_of_truncated_models():
    config = tiny_config(vocab_size=40, num_layers=3)
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jnp.asarray([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], jnp.int32)
    hidden, _, tapped = model.tapped_features(tokens, model.init_cache(2, 8), (0, 2))
    plain, _ = model.features(tokens, model.init_cache(2, 8))
    np.testing.assert_array_equal(hidden, plain)
    assert tapped.shape == (2, 5, 2 * config.hidden_size)
    e = config.hidden_size
    for block, part in ((0, tapped[..., :e]), (2, tapped[..., e:])):
        # The stream after block i is what a model of i + 1 blocks feeds its final norm.
        short = truncate(model, block + 1)
        want, _ = short.features(tokens, short.init_cache(2, 8))
        np.testing.assert_allclose(short.norm(part), want, atol=1e-5, rtol=1e-5)


def test_a_tap_outside_the_blocks_is_named():
    model = Transformer(tiny_config(vocab_size=40, num_layers=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"taps must be block indices in \[0, 2\), got \(2,\)"):
        model.tapped_features(jnp.zeros((1, 2), jnp.int32), model.init_cache(1, 4), (2,))
