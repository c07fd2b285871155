"""Automatic degradation: the ladder of cheaper answers a model steps down when its SLO burns."""
