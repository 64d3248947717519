"""Evaluation: the contract run on a candidate and its parent, the checkers that judge each
answer, the sandbox for code, and the promotion rule's power."""
