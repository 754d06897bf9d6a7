"""rlrepro.rollout"""
