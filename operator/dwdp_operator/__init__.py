"""dwdp_operator: the kopf operator for DwdpGroup resources."""
