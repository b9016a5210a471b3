"""Logit n-gram stores: what STAND drafts from, shared by every trajectory of a problem."""
