"""Content hashes for prefix caching.

A block's hash covers its parent's hash and its own token ids, so equal hashes
mean equal whole prefixes, not just equal 16-token windows. The hash is BLAKE2b
(128-bit), not Python's `hash()`: it must be identical across processes and
restarts (a journal replay or a cache-aware router compares them), and 128
bits make an accidental collision, which would silently serve another prompt's
KV, negligible. Hashes are kept as 16-byte `bytes`: cheaper to chain than ints.

Token ids are hashed as little-endian uint32 (what the API carries), packed
once per request with `encode_tokens`, so hashing a block is one BLAKE2b call
over a slice, with no per-token conversion on the allocation path.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

DIGEST_SIZE = 16
_DOMAIN = b"pagedkv/v1 block hash"
_SWAP = sys.byteorder != "little"


def root_hash(salt: bytes = b"", tenant: bytes = b"") -> bytes:
    """The parent hash of a sequence's first block: the chain's extra keys.

    The tenant and the request's cache salt each give a separate hash space
    (as vLLM's cache_salt and SGLang's extra_key do), so two tenants, or two
    salts, with the same prompt never share, or time-probe, each other's KV.
    The tenant is length-prefixed, so no two (tenant, salt) pairs give the
    same key.
    """
    return blake2b(_DOMAIN + len(tenant).to_bytes(2, "big") + tenant + salt, digest_size=DIGEST_SIZE).digest()


def encode_tokens(token_ids: Sequence[int]) -> array[int]:
    """Token ids as a uint32 array; raises OverflowError outside [0, 2**32)."""
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - every mainstream platform has 4-byte unsigned int
        arr = array("L", token_ids)
    return arr


def _block_bytes(arr: array[int]) -> bytes:
    if _SWAP:  # pragma: no cover - big-endian hosts
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def chain_hash(parent: bytes, block_tokens: array[int]) -> bytes:
    """Hash of one full block given its parent's hash."""
    return blake2b(parent + _block_bytes(block_tokens), digest_size=DIGEST_SIZE).digest()


def chain_hashes(parent: bytes, tokens: array[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Hashes of the first `num_blocks` full blocks of `tokens`."""
    data = _block_bytes(tokens)
    width = block_size * tokens.itemsize
    hashes = []
    for i in range(num_blocks):
        parent = blake2b(parent + data[i * width : (i + 1) * width], digest_size=DIGEST_SIZE).digest()
        hashes.append(parent)
    return hashes


ROOT_HASH = root_hash()
