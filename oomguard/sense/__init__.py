"""Sensors: what the kernel tells, read into frozen dataclasses; no decisions here."""
