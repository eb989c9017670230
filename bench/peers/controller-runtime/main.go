// Command controller-runtime-peer does the operator's job (see src/reconcile.rs) with
// controller-runtime, the way its book and examples teach: a manager with leader election,
// a controller For MyResource that Owns ConfigMaps and Watches Pods through a map function,
// CreateOrUpdate for the ConfigMap, a field index for the Pods, the status written through
// the status subresource when it changed, and Events from the manager's recorder.
//
// It exists only to be measured beside the operator by `cargo xtask bench --peers`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/recorder"
)

// Version is the controller-runtime release this peer is built with (keep in step with go.mod).
const Version = "v0.25.3"

const (
	podLabel       = "trstringer.com/myresource"
	managedByLabel = "app.kubernetes.io/managed-by"
	managedBy      = "myresource-operator"
	podOwnerIndex  = ".metadata.labels.myresource"
)

func main() {
	var (
		identity       string
		namespace      string
		metricsAddr    string
		healthAddr     string
		leaseDuration  time.Duration
		renewDeadline  time.Duration
		retryPeriod    time.Duration
		warmup         bool
		maxConcurrency int
	)
	flag.StringVar(&identity, "identity", "", "replica name, sent in the user agent")
	flag.StringVar(&namespace, "namespace", "default", "namespace to watch and hold the Lease in")
	flag.StringVar(&metricsAddr, "metrics-bind-address", "127.0.0.1:8080", "metrics endpoint")
	flag.StringVar(&healthAddr, "health-probe-bind-address", "127.0.0.1:8081", "probe endpoint")
	flag.DurationVar(&leaseDuration, "lease-duration", 15*time.Second, "Lease duration")
	flag.DurationVar(&renewDeadline, "renew-deadline", 10*time.Second, "renew deadline")
	flag.DurationVar(&retryPeriod, "retry-period", 2*time.Second, "retry period")
	flag.BoolVar(&warmup, "warmup", false, "start the controller's sources before leading (EnableWarmup)")
	flag.IntVar(&maxConcurrency, "max-concurrent-reconciles", 1, "MaxConcurrentReconciles")
	opts := zap.Options{}
	opts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&opts)))
	log := ctrl.Log.WithName("setup")

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		panic(err)
	}
	if err := AddToScheme(scheme); err != nil {
		panic(err)
	}
	config := ctrl.GetConfigOrDie()
	config.UserAgent = fmt.Sprintf("controller-runtime-peer/%s (%s)", Version, identity)

	mgr, err := ctrl.NewManager(config, ctrl.Options{
		Scheme:                        scheme,
		Cache:                         cache.Options{DefaultNamespaces: map[string]cache.Config{namespace: {}}},
		Metrics:                       metricsserver.Options{BindAddress: metricsAddr},
		HealthProbeBindAddress:        healthAddr,
		LeaderElection:                true,
		LeaderElectionID:              "myresource-operator",
		LeaderElectionNamespace:       namespace,
		LeaderElectionReleaseOnCancel: true,
		LeaseDuration:                 &leaseDuration,
		RenewDeadline:                 &renewDeadline,
		RetryPeriod:                   &retryPeriod,
	})
	if err != nil {
		log.Error(err, "unable to create the manager")
		os.Exit(1)
	}
	ctx := ctrl.SetupSignalHandler()
	// The book's CronJob tutorial indexes Jobs by owner so a reconcile lists only its own;
	// here the Pods are indexed by the label that names their MyResource.
	err = mgr.GetFieldIndexer().IndexField(ctx, &corev1.Pod{}, podOwnerIndex, func(o client.Object) []string {
		if owner, ok := o.GetLabels()[podLabel]; ok {
			return []string{owner}
		}
		return nil
	})
	if err != nil {
		log.Error(err, "unable to index Pods")
		os.Exit(1)
	}
	r := &Reconciler{
		Client:   mgr.GetClient(),
		Scheme:   mgr.GetScheme(),
		Recorder: mgr.GetEventRecorder("myresource-operator"),
	}
	err = ctrl.NewControllerManagedBy(mgr).
		For(&MyResource{}).
		Owns(&corev1.ConfigMap{}).
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(podToMyResource)).
		WithOptions(controller.Options{MaxConcurrentReconciles: maxConcurrency, EnableWarmup: &warmup}).
		Complete(r)
	if err != nil {
		log.Error(err, "unable to create the controller")
		os.Exit(1)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		log.Error(err, "unable to set up the health check")
		os.Exit(1)
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		log.Error(err, "unable to set up the ready check")
		os.Exit(1)
	}
	log.Info("starting manager", "identity", identity, "namespace", namespace, "warmup", warmup)
	if err := mgr.Start(ctx); err != nil {
		log.Error(err, "problem running manager")
		os.Exit(1)
	}
}

// podToMyResource maps a labelled Pod to the MyResource its label names.
func podToMyResource(_ context.Context, o client.Object) []reconcile.Request {
	owner, ok := o.GetLabels()[podLabel]
	if !ok {
		return nil
	}
	return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: owner}}}
}

// Reconciler reconciles a MyResource.
type Reconciler struct {
	client.Client
	Scheme   *runtime.Scheme
	Recorder recorder.EventRecorder
}

// Reconcile keeps the MyResource's ConfigMap and status in step with its spec and Pods.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var mr MyResource
	if err := r.Get(ctx, req.NamespacedName, &mr); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !mr.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}

	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: mr.Name, Namespace: mr.Namespace}}
	op, err := controllerutil.CreateOrUpdate(ctx, r.Client, cm, func() error {
		if cm.Labels == nil {
			cm.Labels = map[string]string{}
		}
		cm.Labels[managedByLabel] = managedBy
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		cm.Data["message"] = mr.Spec.Message
		cm.Data["someValue"] = fmt.Sprint(mr.Spec.SomeValue)
		return controllerutil.SetControllerReference(&mr, cm, r.Scheme)
	})
	if err != nil {
		return ctrl.Result{}, err
	}
	switch op {
	case controllerutil.OperationResultCreated:
		r.Recorder.Eventf(&mr, nil, corev1.EventTypeNormal, "ConfigMapCreated", "Reconcile", "ConfigMap %s created", mr.Name)
	case controllerutil.OperationResultUpdated:
		r.Recorder.Eventf(&mr, nil, corev1.EventTypeNormal, "ConfigMapUpdated", "Reconcile", "ConfigMap %s updated", mr.Name)
	}

	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(mr.Namespace), client.MatchingFields{podOwnerIndex: mr.Name}); err != nil {
		return ctrl.Result{}, err
	}
	counts := PodCounts{Total: int32(len(pods.Items))}
	for i := range pods.Items {
		for _, c := range pods.Items[i].Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				counts.Ready++
			}
		}
	}

	status := *mr.Status.DeepCopy()
	status.ObservedGeneration = mr.Generation
	meta.SetStatusCondition(&status.Conditions, metav1.Condition{
		Type:   "Ready",
		Status: metav1.ConditionTrue,
		Reason: "Reconciled",
		Message: fmt.Sprintf("ConfigMap %s holds the spec of generation %d; %d of %d labelled Pods are Ready",
			mr.Name, mr.Generation, counts.Ready, counts.Total),
		ObservedGeneration: mr.Generation,
	})
	status.ConfigMapName = mr.Name
	status.Pods = &counts
	if !equality.Semantic.DeepEqual(mr.Status, status) {
		mr.Status = status
		if err := r.Status().Update(ctx, &mr); err != nil {
			return ctrl.Result{}, err
		}
	}
	return ctrl.Result{}, nil
}
