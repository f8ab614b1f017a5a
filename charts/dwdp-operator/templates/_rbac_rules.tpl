{{- /* The operator's rules inside one namespace: a Role per watched namespace, or part of the ClusterRole (rbac.yaml). */ -}}
{{- define "dwdp-operator.namespacedRules" }}
  # the custom resource: watched, read fresh each reconcile; only its status is written
  - apiGroups: [dwdp.io]
    resources: [dwdpgroups]
    verbs: [get, list, watch]
  - apiGroups: [dwdp.io]
    resources: [dwdpgroups/status]
    verbs: [patch]
  {{- if .Values.groupAutoscaling.enabled }}
  # spec.autoscaling: numGroups through the scale subresource (what kubectl scale and an HPA write), nothing else
  - apiGroups: [dwdp.io]
    resources: [dwdpgroups/scale]
    verbs: [patch]
  {{- end }}
  # worker pods: indexed (list/watch), created, deleted as whole groups, patched (gang gate, serving label)
  - apiGroups: [""]
    resources: [pods]
    verbs: [list, watch, create, delete, patch]
  # the client Service and the rank (headless) Service, one of each per DwdpGroup
  - apiGroups: [""]
    resources: [services]
    verbs: [create]
  # one NetworkPolicy per DwdpGroup: the store port only from the DwdpGroup's own worker pods
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [create]
  # the group token Secret: created once, never read back by the operator
  - apiGroups: [""]
    resources: [secrets]
    verbs: [create]
  # Events for every restart, scale step, invalid spec and refused child
  # (core v1 only: neither the operator nor kopf posts through events.k8s.io)
  - apiGroups: [""]
    resources: [events]
    verbs: [create]
  # one IMEX ComputeDomain per DwdpGroup
  - apiGroups: [resource.nvidia.com]
    resources: [computedomains]
    verbs: [create]
  {{- if .Values.gatewayInferenceExtension.enabled }}
  # an InferencePool per DwdpGroup that sets spec.inferencePool (deleted when it is removed)
  - apiGroups: [inference.networking.k8s.io]
    resources: [inferencepools]
    verbs: [create, delete]
  {{- end }}
{{- end }}
