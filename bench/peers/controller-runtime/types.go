package main

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

// The MyResource API (trstringer.com/v1), as kubebuilder would lay it out in api/v1; the
// deep copies are written by hand instead of by controller-gen.

// GroupVersion is the API group and version of MyResource.
var GroupVersion = schema.GroupVersion{Group: "trstringer.com", Version: "v1"}

var schemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

// AddToScheme adds MyResource and MyResourceList to a scheme.
var AddToScheme = schemeBuilder.AddToScheme

func init() {
	schemeBuilder.Register(&MyResource{}, &MyResourceList{})
}

// MyResourceSpec is the desired state.
type MyResourceSpec struct {
	Message   string `json:"message"`
	SomeValue int32  `json:"someValue"`
}

// PodCounts counts the labelled Pods and the Ready ones among them.
type PodCounts struct {
	Total int32 `json:"total"`
	Ready int32 `json:"ready"`
}

// MyResourceStatus is the observed state.
type MyResourceStatus struct {
	ObservedGeneration int64              `json:"observedGeneration,omitempty"`
	Conditions         []metav1.Condition `json:"conditions,omitempty"`
	ConfigMapName      string             `json:"configMapName,omitempty"`
	Pods               *PodCounts         `json:"pods,omitempty"`
}

// MyResource is the custom resource.
type MyResource struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              MyResourceSpec   `json:"spec,omitempty"`
	Status            MyResourceStatus `json:"status,omitempty"`
}

// MyResourceList is a list of MyResources.
type MyResourceList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []MyResource `json:"items"`
}

// DeepCopy copies the status.
func (in *MyResourceStatus) DeepCopy() *MyResourceStatus {
	out := *in
	if in.Conditions != nil {
		out.Conditions = make([]metav1.Condition, len(in.Conditions))
		for i := range in.Conditions {
			in.Conditions[i].DeepCopyInto(&out.Conditions[i])
		}
	}
	if in.Pods != nil {
		pods := *in.Pods
		out.Pods = &pods
	}
	return &out
}

// DeepCopyInto copies the receiver into out.
func (in *MyResource) DeepCopyInto(out *MyResource) {
	*out = *in
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	out.Status = *in.Status.DeepCopy()
}

// DeepCopyObject implements runtime.Object.
func (in *MyResource) DeepCopyObject() runtime.Object {
	out := new(MyResource)
	in.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *MyResourceList) DeepCopyObject() runtime.Object {
	out := new(MyResourceList)
	*out = *in
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]MyResource, len(in.Items))
		for i := range in.Items {
			in.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
	return out
}
