"""learnkv.settings: a decode's eviction settings as one object, one feasibility check, one place a policy is resolved."""

import pytest
import torch

from conftest import params_for, random_ids
from learnkv import generate
from learnkv.settings import Eviction, batch_groups, resolve_policy


def test_check_refuses_what_cannot_decode_with_the_messages_of_every_entry_point():
    Eviction("h2o", {"n_recent": 4}).check(16)  # fits
    Eviction("full", prefill="snapkv").check()  # a prefill policy beside the full cache: unused, but a valid one
    for eviction, budget, message in [
        (Eviction("h2o", {"n_recent": 10}), 4, "policy 'h2o': .* do not fit in a budget of 4 tokens"),
        (Eviction("nope"), None, "unknown policy 'nope'"),
        (Eviction("h2o", {"bogus": 1}), None, "policy 'h2o' has no parameter bogus"),
        (Eviction("learned"), None, r"policy 'learned' needs a scorer artifact: --scorer PATH"),
        (Eviction("h2o", scorer="/no/such/scorer"), None, "scorer artifact '/no/such/scorer' does not exist"),
        (Eviction("h2o", {"block_size": 4}, granularity="block"), 64, "block_size has no effect in block granularity"),
        (Eviction("h2o", prefill="snapkv", prefill_params={"window": 40}), 16, "policy 'snapkv': .* do not fit"),
        (Eviction("h2o", prefill="oracle"), None, "^policy 'oracle' cannot be a prefill policy"),
    ]:
        with pytest.raises(ValueError, match=message):
            eviction.check(budget)
    with pytest.raises(ValueError, match="do not fit in a budget of 4 tokens"):  # a token budget of its own
        Eviction("h2o", {"n_recent": 10}, budget=4).check()
    Eviction("h2o", {"n_recent": 10}, budget=0.5).check()  # a fraction's tokens depend on the prompt: checked later
    with pytest.raises(ValueError, match="^--prefill-policy: policy 'lazy' cannot be a prefill policy"):
        Eviction("h2o", prefill="lazy").check(prefill_option="--prefill-policy")


def test_resolve_refuses_a_blind_prefill_and_resolves_each_row():
    with pytest.raises(ValueError, match="policy 'lazy' observes nothing at the prefill, and a prompt of 40 tokens"):
        Eviction("lazy").resolve([16], prompt_lengths=[40])
    rows, prefill = Eviction("lazy").resolve([16, 64], prompt_lengths=[10, 40])  # each prompt within its budget
    assert prefill is None and [r.window for r in rows] == [resolve_policy("lazy", b).window for b in (16, 64)]
    rows, prefill = Eviction("lazy", prefill="snapkv").resolve([16], prompt_lengths=[40])
    assert [p.name for p in prefill] == ["snapkv"] and prefill[0].window == resolve_policy("snapkv", 16).window
    rows, prefill = Eviction("full", prefill="snapkv").resolve([None])  # nothing evicted: no prefill policy
    assert prefill is None and rows[0].name == "full"
    rows, _ = Eviction("h2o", granularity="block", block_size=8).resolve([64])
    assert rows[0].block_size == 8


def test_the_scorer_goes_to_a_learned_policy_that_names_none():
    assert Eviction("learned", scorer="s").policy_params == {"scorer": "s"}
    assert Eviction("learned", {"scorer": "mine"}, scorer="s").policy_params == {"scorer": "mine"}
    assert Eviction("h2o", {"n_sink": 2}, scorer="s").policy_params == {"n_sink": 2}
    assert Eviction("h2o", prefill="learned", scorer="s").prefill_policy_params == {"scorer": "s"}
    assert Eviction("learned", {"n_sink": 1}).params == {"n_sink": 1}  # never changed in place


def test_generate_with_the_settings_decodes_as_with_loose_arguments(tiny):
    ids = random_ids(30, batch=2, seed=3)
    scorer = params_for("learned", 2)["scorer"]
    for eviction in [Eviction("h2o", {"n_recent": 4}, budget=[12, 16], slack=3),
                     Eviction("lazy", budget=0.5, prefill="snapkv", prefill_params={"window": 2}),
                     Eviction("learned", budget=16, granularity="block", block_size=4, scorer=scorer),
                     Eviction("full")]:
        loose = dict(policy=eviction.policy, budget=eviction.budget, policy_params=eviction.policy_params,
                     granularity=eviction.granularity, block_size=eviction.block_size, slack=eviction.slack)
        if eviction.prefill:
            loose.update(prefill_policy=eviction.prefill, prefill_params=eviction.prefill_params)
        a = generate(tiny, input_ids=ids, max_new_tokens=12, **loose)
        b = generate(tiny, None, None, eviction, input_ids=ids, max_new_tokens=12)
        assert torch.equal(a.tokens, b.tokens) and a.kept_rows == b.kept_rows and a.params == b.params
        assert (a.policy, a.prefill_policy, a.budgets) == (b.policy, b.prefill_policy, b.budgets)


def test_batch_groups_split_rows_where_a_shared_default_differs():
    """One helper for evaluation and collection: the rows of one resolution decode together, as each did before
    (collection grouped by the resolved parameters but the per-row ones)."""
    budgets = [16, 400, 16, 64]

    def by_params(name):  # the rule trace collection had
        groups: dict = {}
        for i, b in enumerate(budgets):
            p = resolve_policy(name, b)
            groups.setdefault(repr({k: v for k, v in p.params().items() if k not in p.per_row_fields}), []).append(i)
        return list(groups.values())

    for name in ("lazy", "rkv", "h2o", "snapkv", "tova", "roco"):
        assert batch_groups(Eviction(name), budgets) == by_params(name), name
    assert batch_groups(Eviction("rkv"), budgets) == [[0, 2], [1, 3]]  # R-KV's window is a budget share, not per row
    assert batch_groups(Eviction("lazy"), budgets) == [[0, 1, 2, 3]]  # LazyEviction's is per row
    assert batch_groups(Eviction("full"), [None] * 3) == [[0, 1, 2]]
    # a prefill policy's shared fields count too: R-KV's window splits h2o's rows
    assert batch_groups(Eviction("h2o", prefill="rkv"), budgets) == [[0, 2], [1, 3]]


def test_generate_takes_an_eviction_or_its_fields_not_both(tiny):
    """One settings object: generate refuses it beside loose eviction keywords, a misspelt keyword, or another
    type in its place, each in one line."""
    ids = random_ids(12, batch=1, seed=1)
    with pytest.raises(TypeError, match="not both"):
        generate(tiny, None, None, Eviction("h2o", budget=8), budget=8, input_ids=ids)
    with pytest.raises(TypeError, match="unexpected keyword argument 'budjet'"):
        generate(tiny, input_ids=ids, budjet=8)
    with pytest.raises(TypeError, match="is a learnkv.Eviction"):
        generate(tiny, None, None, {"policy": "h2o"}, input_ids=ids)


@pytest.mark.parametrize("fields, message", [({"granularity": "page"}, "granularity must be 'token' or 'block', got 'page'"),
                                             ({"granularity": "block", "block_size": 0}, "block size must be an integer >= 1, got 0"),
                                             ({"block_size": 2.5}, "block size must be an integer >= 1, got 2.5")])
def test_granularity_is_checked_once_with_one_message_at_every_entry_point(tiny, fields, message):
    """The settings object refuses a bad granularity or block size when it is made; `generate` (its keywords) and an
    evaluation task (its own fields) say the same, from the same check."""
    from learnkv.eval.tasks import TASKS

    with pytest.raises(ValueError, match=message):
        Eviction("h2o", budget=8, **fields)
    with pytest.raises(ValueError, match=message):
        generate(tiny, input_ids=random_ids(8), policy="h2o", budget=8, max_new_tokens=2, **fields)
    with pytest.raises(ValueError, match=message):
        TASKS["fidelity"](**fields)
