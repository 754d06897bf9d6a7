"""rlrepro.trainer"""
