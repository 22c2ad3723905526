import pytest

from kvflow.errors import ConfigError
from kvflow.hashing import BlockHasher, ExtraKeys, MMItem


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_chained_and_deterministic(algo):
    h = BlockHasher(4, algo)
    a = h.hash_blocks(range(10))
    assert len(a) == 2  # the partial tail gets no hash
    assert a == h.hash_blocks(list(range(10)))
    # Resuming from a parent gives the same hash as hashing the whole sequence.
    assert h.hash_blocks(range(4, 8), parent=a[0]) == [a[1]]
    # Same block of tokens under a different prefix: different hash.
    assert h.hash_blocks([9, 9, 9, 9, 4, 5, 6, 7])[1] != a[1]


def test_algorithms_differ():
    assert BlockHasher(4, "sha256").hash_blocks(range(4)) != BlockHasher(
        4, "xxh3_128").hash_blocks(range(4))


def test_extra_keys_separate_tenants_loras_and_images():
    h = BlockHasher(4)
    toks = list(range(8))
    base = h.hash_blocks(toks)
    salt_a = h.hash_blocks(toks, extra=ExtraKeys(tenant_salt="a"))
    salt_b = h.hash_blocks(toks, extra=ExtraKeys(tenant_salt=b"b"))
    assert len({base[1], salt_a[1], salt_b[1]}) == 3
    assert h.hash_blocks(toks, extra=ExtraKeys(lora_id=1))[0] != base[0]
    img = ExtraKeys(mm_items=(MMItem(b"img", offset=5, length=2),))
    with_img = h.hash_blocks(toks, extra=img)
    assert with_img[0] == base[0]  # the image does not overlap block 0
    assert with_img[1] != base[1]


def test_bad_config():
    with pytest.raises(ConfigError, match="algo"):
        BlockHasher(4, "md5")
    with pytest.raises(ConfigError):
        BlockHasher(0)
