"""A one-shot run's warm-up at load (runtime/session_warmup.py) changes no token and leaves the session empty."""
from helmc import api
from helmc.runtime.session import Session
from helmc.runtime.session_warmup import host_kv_caches, warm_up_session


def test_warm_up_leaves_the_session_empty_and_changes_no_token(tiny):
    bundle = tiny.bundle("qwen3")
    prompt = [5, 9, 2, 7, 11, 3]
    cold = api.run(bundle, prompt_ids=prompt, max_new_tokens=12, warm_up=False)
    warm = api.run(bundle, prompt_ids=prompt, max_new_tokens=12)
    assert warm.tokens == cold.tokens and len(warm.tokens) == 12

    session = Session.load(bundle)
    done = warm_up_session(session, len(prompt), 12)
    assert session.position == 0
    assert all(kv.length == 0 for kv in host_kv_caches(session)) and host_kv_caches(session)
    assert done.kv_bytes > 0 and done.seconds > 0
    again = session.generate(prompt_ids=prompt, max_new_tokens=12)
    assert again.tokens == cold.tokens
