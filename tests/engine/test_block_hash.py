import subprocess
import sys

from backend_engine.block_hash import hash_block, hash_prompt_blocks


def test_chain_and_partial_block():
    ids = list(range(40))
    hs = hash_prompt_blocks(ids, 16)
    assert len(hs) == 2  # 8 trailing tokens form no full block
    assert hs[0] == hash_block(None, ids[:16])
    assert hs[1] == hash_block(hs[0], ids[16:32])
    assert all(0 <= h < 2**63 for h in hs)


def test_same_tokens_different_parent_or_salt_differ():
    blk = list(range(16))
    assert hash_block(None, blk) != hash_block(1, blk)
    assert hash_block(None, blk) != hash_block(None, blk, salt="tenant-a")
    assert hash_block(None, blk, salt="tenant-a") != hash_block(None, blk, salt="tenant-b")
    assert hash_prompt_blocks(blk * 2, 16)[1] != hash_prompt_blocks([5] + blk[1:] + blk, 16)[1]


def test_stable_value():
    # Pinned: the gateway and other processes must compute the same hashes forever.
    assert hash_block(None, [1, 2, 3]) == hash_block(None, (1, 2, 3))
    assert hash_block(None, list(range(16))) == 0x0 + int(_pinned())


def _pinned() -> int:
    import hashlib
    import struct

    h = hashlib.blake2b(digest_size=8)
    h.update(b"pcb1" + b"\xff" * 8 + struct.pack("<I", 0) + struct.pack("<16I", *range(16)))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def test_importable_without_numpy():
    code = "import sys, backend_engine.block_hash as b; b.hash_prompt_blocks([1]*32); print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
