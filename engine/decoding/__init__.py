"""How the next tokens are chosen: the sampler (sampler.py), speculative decoding (speculation.py: the cost
model and the Speculator; proposers.py, suffix_proposer.py, draft_proposer.py: what proposes; rejection_sampler.py:
what verifies) and structured output's grammars and their token masks (grammar.py, grammar_masks.py)."""
