"""The harness's own contract: markers, options and the impl fixture."""

import pytest
from hypothesis import settings

pytestmark = pytest.mark.cpu


def test_hypothesis_profile_is_loaded(pytestconfig):
    assert settings.default.max_examples >= 1
    assert pytestconfig.dsv4_profile in {"dev", "ci", "thorough"}


def test_missing_entry_point_raises_impl_missing(impl):
    from fixtures.impl_loader import ImplMissing

    with pytest.raises(ImplMissing, match="no_such_entry_point"):
        impl.no_such_entry_point()
