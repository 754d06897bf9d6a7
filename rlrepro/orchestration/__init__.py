"""rlrepro.orchestration"""
