"""`--sampling` of the GPU benchmarks (`gpu_engine`, `gpu_profile`): each spec becomes the
SamplingParams fields a decode step samples with, and a field it does not know is an
error that names the ones it does."""

from __future__ import annotations

import pytest

from baton.benchmarks.lab.gpu_setup import sampling_knobs
from baton.common.sampling import SamplingParams


def test_a_spec_is_the_fields_it_names() -> None:
    assert sampling_knobs("greedy") == {"temperature": 0.0}
    knobs = sampling_knobs("temperature=0.7,top_p=0.9,top_k=50,repetition_penalty=1.1")
    assert knobs == {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    assert isinstance(knobs["top_k"], int)
    SamplingParams(**knobs)  # valid settings


def test_an_unknown_field_is_named() -> None:
    with pytest.raises(ValueError, match="'topp' is not one of temperature"):
        sampling_knobs("temperature=1,topp=0.9")
