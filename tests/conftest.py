import os

import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures")
if not os.path.isdir(FIXTURES):  # CI lays shared/ beside the clone; a checkout may also carry it inside
    FIXTURES = os.path.join(os.path.dirname(__file__), "..", "shared", "fixtures")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixtures_dir():
    if not os.path.isdir(FIXTURES):
        pytest.skip("shared/fixtures not found beside the repository")
    return FIXTURES


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One torch thread for every test: on the shared 2-core machines (and with several ranks on them),
    spinning OpenMP threads make thousands of tiny CPU ops crawl."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def check_cache(monkeypatch):
    """The cache's integrity check after every engine step, in every test (worker ranks inherit it); a test of
    the switch itself sets it as it needs."""
    from dsv4.cache import CHECK_ENV

    monkeypatch.setenv(CHECK_ENV, "1")


@pytest.fixture
def count_overlapped(monkeypatch):
    """Counts the target passes that took an input still on the device (the overlap scheduler's steps)."""
    from dsv4.engine import runner as runner_mod

    seen = []
    real = runner_mod.pending_inputs

    def counting(seqs, prev):
        dst, src = real(seqs, prev)
        seen.append(len(dst))
        return dst, src

    monkeypatch.setattr(runner_mod, "pending_inputs", counting)
    return seen


@pytest.fixture
def verify_path(monkeypatch):
    """Where MTP steps verify: set ``["device"] = False`` to force the host path (``spec.accept_sampled`` /
    ``accept_greedy``, what the multi-rank driver runs; MTP steps then do not overlap either). Counts the verify
    steps (steps with drafts) that took each path in ``["on_device"]`` (overlapped or not; ``["overlapped"]``
    the overlapped ones) / ``["on_host"]``."""
    from dsv4.engine.engine import LLMEngine

    state = {"device": True, "on_device": 0, "on_host": 0, "overlapped": 0}
    real = LLMEngine._verifies_on_device
    real_launch = LLMEngine._launch_mtp
    real_overlaps = LLMEngine.overlaps_steps

    def verifies_on_device(self, seqs):
        ok = state["device"] and real(self, seqs)
        if any(s.drafts for s in seqs):
            state["on_device" if ok else "on_host"] += 1
        return ok

    def launch_mtp(self, seqs, plan, target, drafting):
        if any(s.drafts for s in seqs):
            state["on_device"] += 1
            state["overlapped"] += 1
        return real_launch(self, seqs, plan, target, drafting)

    monkeypatch.setattr(LLMEngine, "_verifies_on_device", verifies_on_device)
    monkeypatch.setattr(LLMEngine, "_launch_mtp", launch_mtp)
    monkeypatch.setattr(LLMEngine, "overlaps_steps",
                        property(lambda self: real_overlaps.fget(self) and (state["device"] or not self.draft_len)))
    return state


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A random tiny checkpoint in DeepSeek's layout and a one-request dataset beside it (bad-input tests break
    copies of it)."""
    from dsv4.checkpoint.init_random import init_random_checkpoint

    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    init_random_checkpoint("tiny", str(d), seed=0)
    ds = d.parent / "ds.jsonl"
    ds.write_text('{"task_id": 0, "input_ids": [1, 2, 3], "output_tokens": 2}\n')
    return d, ds
