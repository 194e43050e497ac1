"""Speculative decoding: drafters (prompt lookup, a draft model), the planner and its step costs."""
