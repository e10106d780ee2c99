"""Heads that draft from the target's own hidden state (Medusa / Hydra-style), trained on this machine.

``train.train_heads`` records the target's greedy answers with their hidden states and fits the heads;
``store`` keeps them beside the model; ``ondevice.drafters.heads.HeadsDrafter`` drafts from the hidden state the last
target pass produced (``ondevice.load(model, draft="heads")``), verified by the shared rejection sampler.
"""
