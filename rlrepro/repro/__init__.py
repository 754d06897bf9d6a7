"""rlrepro.repro"""
