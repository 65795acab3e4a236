"""The tiny-checkpoint writer refuses to overwrite a directory and nonsense sizes."""

import subprocess
import sys

import pytest

from mcore_refit.tiny import TinyModelSpec, write_tiny_checkpoint
from tests.launch import REPO_ROOT


@pytest.mark.slow
def test_a_non_empty_directory_is_refused_and_left_as_it_was(tmp_path):
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"a user's weights")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "recipes" / "make_tiny_model.py"),
                             str(tmp_path), "--layers", "2"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"make_tiny_model.py: error: '{tmp_path}' exists and is not an empty directory; "
        "writing a checkpoint there would replace (and delete the *.safetensors of) what it "
        "holds: choose a new or empty directory")
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert shard.read_bytes() == b"a user's weights"


def test_an_empty_directory_is_written(tmp_path):
    write_tiny_checkpoint(tmp_path, TinyModelSpec(num_layers=1))
    assert (tmp_path / "config.json").is_file()


@pytest.mark.parametrize(("sizes", "message"), [
    ({"num_layers": 0}, "num_layers must be a positive integer, got 0"),
    ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"hidden_size": 62}, "hidden_size=62 is not a multiple of num_attention_heads=4"),
])
def test_nonsense_sizes_are_refused(sizes, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        TinyModelSpec(**sizes)
