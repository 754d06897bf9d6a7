"""rlrepro.model"""
