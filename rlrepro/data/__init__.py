"""rlrepro.data"""
