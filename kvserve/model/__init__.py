"""kvserve.model"""
