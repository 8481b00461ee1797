"""Speculative decoding's parts, before their engine integration (issue 25): the n-gram prompt-lookup proposer
(engine/decoding/proposers.py) and verification (engine/decoding/rejection_sampler.py), whose sampled tokens must follow
the target distribution exactly (a chi-square test over many seeds on a small vocabulary) and whose greedy tokens are
the target's argmax."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.decoding.proposers import NgramProposer
from tandem.engine.decoding.rejection_sampler import Verified, verify_greedy, verify_sampled

# Chi-square critical values at significance 0.001 by degrees of freedom: a correct sampler fails 1 run in 1000.
CHI2_0_001 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    proposer = NgramProposer(min_n=2, max_n=3)
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3]
    # the suffix (2, 3) last occurred at positions 6-7, followed by 4, 7, 8
    assert proposer.propose("s", seq, 3) == [4, 7, 8]
    assert proposer.propose("s", seq + [4], 2) == [7, 8]  # (2, 3, 4), the longest match, latest occurrence
    assert proposer.propose("s", seq + [4, 6], 3) == []  # (4, 6) never occurred before
    assert proposer.propose("t", [5, 5, 5, 5], 4) == [5]  # only what the sequence holds


def test_a_sequence_cut_back_is_indexed_again_and_forget_drops_it():
    proposer = NgramProposer(min_n=1, max_n=2)
    assert proposer.propose("s", [1, 2, 3, 1, 2, 9, 9], 2) == [9]
    assert proposer.propose("s", [1, 2, 3, 1], 2) == [2, 3]  # rolled back: 9, 9 no longer in the index
    proposer.forget("s")
    assert "s" not in proposer._seqs
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)


def test_lookup_work_per_step_does_not_grow_with_the_prompt():
    proposer = NgramProposer(min_n=2, max_n=4)
    prompt = list(range(20_000))
    proposer.propose("s", prompt, 4)
    index = proposer._seqs["s"]
    sizes = {n: len(g) for n, g in index.grams.items()}
    proposer.propose("s", prompt + [7], 4)
    assert {n: len(g) - sizes[n] for n, g in index.grams.items()} == {2: 1, 3: 1, 4: 1}  # one new gram per n


def test_greedy_verification_keeps_the_matching_prefix_then_the_targets_own_token():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 1]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == Verified((3, 5, 7, 1), 3)  # all accepted, then the bonus
    assert verify_greedy(logits, [3, 6, 7]) == Verified((3, 5), 1)  # the first mismatch is corrected
    assert verify_greedy(logits[:1], []) == Verified((3,), 0)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft-model", "deterministic"])
def test_sampled_tokens_follow_the_target_distribution(with_draft):
    vocab, k, runs = 6, 2, 6000
    torch.manual_seed(0)  # fixed distributions and draft draws: the test is deterministic, never flaky
    gen = torch.Generator().manual_seed(0)
    target = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k + 1,)).clamp_min(0.02)
    target = target / target.sum(-1, keepdim=True)
    draft = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k,)) if with_draft else None
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    accepted_first = 0
    for seed in range(runs):
        if with_draft:  # the draft model's own draws
            proposed = [int(torch.multinomial(draft[i], 1, generator=gen)) for i in range(k)]
        else:
            proposed = [0, 1]
        out = verify_sampled(target, proposed, seed=seed, step=0, draft_probs=draft)
        first[out.tokens[0]] += 1
        if out.num_accepted >= 1:  # the first token was the proposal: the second is again an exact draw
            second[out.tokens[1]] += 1
            accepted_first += 1
    assert _chi2(first, target[0]) < CHI2_0_001[vocab - 1]
    # Given the first proposal accepted, the second token follows the target's second distribution.
    assert accepted_first > 300 and _chi2(second, target[1]) < CHI2_0_001[vocab - 1]


def test_verification_is_reproducible_from_the_seed_and_checks_shapes():
    target = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    runs = {verify_sampled(target, [4, 9], seed=123, step=7) for _ in range(3)}
    assert len(runs) == 1
    assert len({verify_sampled(target, [4, 9], seed=s, step=7) for s in range(40)}) > 1
    with pytest.raises(ValueError, match="target_probs must be"):
        verify_sampled(target, [4], seed=1, step=0)
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_sampled(target, [4, 9], seed=1, step=0, draft_probs=torch.ones(1, 50))


def test_suffix_proposals_come_from_the_requests_own_tokens():
    from tandem.engine.decoding.suffix_proposer import SuffixProposer

    proposer = SuffixProposer(depth=8, match=4)
    proposer.start("a", salt=None)
    seq = [7, 1, 2, 3, 4, 8, 9, 1, 2]
    assert proposer.propose("a", seq, 3) == [3, 4, 8]
    assert proposer.propose("a", seq + [3, 4, 8], 2) == [9, 1]  # its trie grew with the new tokens
    assert proposer.propose("a", [5, 6], 2) == []  # cut back to two unseen tokens: indexed again, no match


def test_finished_outputs_are_shared_within_a_tenant_only_and_the_cache_is_bounded():
    from tandem.engine.decoding.suffix_proposer import SuffixProposer

    proposer = SuffixProposer(depth=8, match=4, cached_requests=1)
    answer = [40, 41, 42, 43, 44, 45]
    proposer.start("first", salt="acme")
    proposer.propose("first", [1, 2, 3], 2)
    proposer.forget("first", answer)
    for seq_id, salt, expected in (("same", "acme", [42, 43, 44]), ("other", "beta", []), ("none", None, [])):
        proposer.start(seq_id, salt=salt)
        assert proposer.propose(seq_id, [9, 40, 41], 3) == expected, salt
    proposer.forget("same", [60, 61, 62])  # the cache holds one request per tenant: the first's output leaves it
    proposer.start("later", salt="acme")
    assert proposer.propose("later", [9, 40, 41], 3) == []
    assert proposer.propose("later", [9, 60, 61], 3) == [62]
    assert 40 not in proposer._shared["acme"].root.children  # its nodes were dropped, not only zeroed


def test_a_continuation_without_a_dominant_next_token_is_not_proposed():
    from tandem.engine.decoding.suffix_proposer import SuffixProposer

    proposer = SuffixProposer(depth=4, match=2, min_share=0.6)
    seq = [1, 2, 5, 1, 2, 6, 1, 2, 7, 1, 2]  # after (1, 2): 5, 6 and 7 once each
    assert proposer.propose("s", seq, 2) == []
    assert SuffixProposer(depth=4, match=2, min_share=0.3).propose("s", seq, 1) in ([5], [6], [7])
    with pytest.raises(ValueError, match="match <= depth"):
        SuffixProposer(depth=2, match=3)
