"""kvserve.tools"""
