"""Tools for operating the platform: the environment check (`envcheck`), the deployment files' validation
(`deploy_check`) and a token-authenticated local head (`local_cluster`), each behind a jobs/ script."""
