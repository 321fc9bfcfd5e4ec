"""The engine's shared vocabulary, below every other layer: the root exceptions (`errors`) and
the plain msgspec shapes that cross layers (`records`). It imports nothing of ours."""
