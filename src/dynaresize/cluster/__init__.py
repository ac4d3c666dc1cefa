"""The cluster shell: Ray placement of long-lived device workers (`placement`) and the
workers themselves. Import submodules explicitly; this package import pulls in no Ray.
"""
